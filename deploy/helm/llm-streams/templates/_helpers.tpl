{{/* Names and labels. */}}
{{- define "llm-streams.name" -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end }}

{{- define "llm-streams.worker" -}}
{{- printf "%s-worker" (include "llm-streams.name" .) -}}
{{- end }}

{{- define "llm-streams.labels" -}}
app.kubernetes.io/name: llm-streams
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{- define "llm-streams.selector" -}}
app.kubernetes.io/name: llm-streams
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: worker
{{- end }}

{{/* The Secret of a secretFiles entry: the user's, or the one the chart makes. */}}
{{- define "llm-streams.secretName" -}}
{{- $entry := index .root.Values.secretFiles .name -}}
{{- $entry.existingSecret | default (printf "%s-%s" (include "llm-streams.name" .root) .name) -}}
{{- end }}

{{/* The settings as LLM_STREAMS_* variables: a nested map is a section (`__`). */}}
{{- define "llm-streams.env" -}}
{{- $prefix := index . 0 -}}
{{- range $key, $value := index . 1 }}
{{- if kindIs "map" $value }}
{{- include "llm-streams.env" (list (printf "%s%s__" $prefix (upper $key)) $value) }}
{{- else if not (kindIs "invalid" $value) }}
{{ printf "%s%s" $prefix (upper $key) }}: {{ $value | toString | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* The settings with what the chart itself decides (the deployments file's path). */}}
{{- define "llm-streams.settings" -}}
{{- $settings := deepCopy .Values.settings -}}
{{- if .Values.deployments -}}
{{- $llm := get $settings "llm" | default dict -}}
{{- $_ := set $llm "deployments_file" "/etc/llm-streams/deployments/deployments.yaml" -}}
{{- $_ := set $settings "llm" $llm -}}
{{- end -}}
{{- toYaml $settings -}}
{{- end }}

{{/* Refuse a release that would start workers that cannot work. */}}
{{- define "llm-streams.checks" -}}
{{- $root := .root -}}
{{- $s := .settings -}}
{{- $mounts := list -}}
{{- range $name, $entry := $root.Values.secretFiles }}
{{- $mounts = append $mounts (trimSuffix "/" $entry.mountPath) -}}
{{- end }}
{{- $kafka := $s.kafka | default dict -}}
{{- $security := $kafka.security | default dict -}}
{{- $files := dict "settings.llm.api_key_file" (($s.llm | default dict).api_key_file) "settings.schema_registry.ca_file" (($s.schema_registry | default dict).ca_file) -}}
{{- range $key := list "ssl_cafile" "ssl_certfile" "ssl_keyfile" "ssl_key_password_file" "sasl_username_file" "sasl_password_file" }}
{{- $_ := set $files (printf "settings.kafka.security.%s" $key) (get $security $key) -}}
{{- end }}
{{- range $i, $d := ($root.Values.deployments.deployments | default list) }}
{{- if $d.api_key_env }}
{{- fail (printf "deployments: %s takes its key from %s, a variable the chart would write to a ConfigMap: give it api_key_file, a file of a secretFiles entry" $d.name $d.api_key_env) }}
{{- end }}
{{- $_ := set $files (printf "deployments: %s: api_key_file" $d.name) $d.api_key_file -}}
{{- end }}
{{- range $setting, $path := $files }}
{{- if and $path (not (has (dir $path) $mounts)) }}
{{- fail (printf "%s is %s, but no secretFiles entry is mounted at %s (mounted: %s)" $setting $path (dir $path) (join ", " $mounts)) }}
{{- end }}
{{- end }}
{{- if ge (float64 (required "settings.shutdown_grace_s is needed: it must be below terminationGracePeriodSeconds" $s.shutdown_grace_s)) (float64 $root.Values.terminationGracePeriodSeconds) }}
{{- fail (printf "settings.shutdown_grace_s (%v) must be below terminationGracePeriodSeconds (%v): the worker needs the rest to leave its group" $s.shutdown_grace_s $root.Values.terminationGracePeriodSeconds) }}
{{- end }}
{{- $partitions := required "settings.kafka.partitions is needed: the chart scales up to it" $kafka.partitions -}}
{{- if and $root.Values.autoscaling.enabled (gt (int $root.Values.autoscaling.maxReplicas) (int $partitions)) }}
{{- fail (printf "autoscaling.maxReplicas (%v) is above settings.kafka.partitions (%v): the extra workers would idle" $root.Values.autoscaling.maxReplicas $partitions) }}
{{- end }}
{{- if ne (toString ($s.web_bind | default "")) "0.0.0.0" }}
{{- fail "settings.web_bind must be 0.0.0.0: probes and scrapes come from outside the pod" }}
{{- end }}
{{- end }}
