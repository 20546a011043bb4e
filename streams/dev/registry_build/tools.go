//go:build tools

package tools

import _ "github.com/axonops/axonops-schema-registry/cmd/schema-registry"
