//go:build tools

// Package tools pins the Helm CLI that the chart's offline tests run (helm lint, helm template).
package tools

import _ "helm.sh/helm/v3/cmd/helm"
