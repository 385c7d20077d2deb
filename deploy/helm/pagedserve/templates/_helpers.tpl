{{/* Names, labels and the pieces every pagedserve pod shares. */}}

{{- define "pagedserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-pagedserve, or <release> when the release's name already says pagedserve. */}}
{{- define "pagedserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The name of one component's objects: <fullname>-<component>. */}}
{{- define "pagedserve.component" -}}
{{- printf "%s-%s" (include "pagedserve.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pagedserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagedserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pagedserve.labels" -}}
{{ include "pagedserve.selectorLabels" . }}
app.kubernetes.io/part-of: pagedserve
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end }}

{{- define "pagedserve.image" -}}
{{- printf "%s:%s" .Values.image.repository .Values.image.tag }}
{{- end }}

{{/* The Secret and key holding PAGEDSERVE_REDIS_URL (it may carry a password). */}}
{{- define "pagedserve.redisSecretName" -}}
{{- if and (not .Values.redis.enabled) .Values.externalRedis.existingSecret }}
{{- .Values.externalRedis.existingSecret }}
{{- else }}
{{- include "pagedserve.component" (dict "root" . "component" "redis-url") }}
{{- end }}
{{- end }}

{{- define "pagedserve.redisSecretKey" -}}
{{- if and (not .Values.redis.enabled) .Values.externalRedis.existingSecret }}
{{- .Values.externalRedis.existingSecretKey }}
{{- else -}}
redis-url
{{- end }}
{{- end }}

{{/* The Redis URL; .password: this chart's Redis' password (redis.auth.enabled). */}}
{{- define "pagedserve.redisUrl" -}}
{{- $root := .root }}
{{- with $root }}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s%s:6379/0" (ternary (printf ":%s@" $.password) "" (and .Values.redis.auth.enabled (ne $.password ""))) (printf "%s-redis" .Release.Name | trunc 63 | trimSuffix "-") }}
{{- else if .Values.externalRedis.url }}
{{- .Values.externalRedis.url }}
{{- else if not .Values.externalRedis.existingSecret }}
{{- fail "Redis: set redis.enabled=true (this chart's Redis), externalRedis.url or externalRedis.existingSecret" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pagedserve.redisAuthSecretName" -}}
{{- printf "%s-redis-auth" .Release.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Mutual TLS between the services (internalTls.enabled): the Secret, its mount and PAGEDSERVE_TLS_*. */}}
{{- define "pagedserve.tlsSecretName" -}}
{{- default (include "pagedserve.component" (dict "root" . "component" "internal-tls")) .Values.internalTls.existingSecret }}
{{- end }}

{{- define "pagedserve.tlsEnv" -}}
{{- if .Values.internalTls.enabled }}
- {name: PAGEDSERVE_TLS_CERT, value: /etc/pagedserve/tls/tls.crt}
- {name: PAGEDSERVE_TLS_KEY, value: /etc/pagedserve/tls/tls.key}
- {name: PAGEDSERVE_TLS_CA, value: /etc/pagedserve/tls/ca.crt}
{{- end }}
{{- end }}

{{- define "pagedserve.tlsMount" -}}
{{- if .Values.internalTls.enabled }}
- {name: internal-tls, mountPath: /etc/pagedserve/tls, readOnly: true}
{{- end }}
{{- end }}

{{- define "pagedserve.tlsVolume" -}}
{{- if .Values.internalTls.enabled }}
- name: internal-tls
  secret: {secretName: {{ include "pagedserve.tlsSecretName" . }}}
{{- end }}
{{- end }}

{{/* A gRPC service's readiness probe: the kubelet's native gRPC probe speaks no TLS, so with
internalTls.enabled the health check runs in the container (python -m pagedserve.healthcheck, with the
service's own certificate). */}}
{{- define "pagedserve.grpcReadiness" -}}
{{- if .root.Values.internalTls.enabled }}
exec: {command: ["python", "-m", "pagedserve.healthcheck", "-q", "127.0.0.1:{{ .port }}"]}
{{- else }}
grpc: {port: {{ .port }}}
{{- end }}
{{- end }}

{{/* The environment every pagedserve service shares: Redis and its key prefix. */}}
{{- define "pagedserve.redisEnv" -}}
- name: PAGEDSERVE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "pagedserve.redisSecretName" . }}
      key: {{ include "pagedserve.redisSecretKey" . }}
- name: PAGEDSERVE_REDIS_PREFIX
  value: {{ .Values.keyPrefix | quote }}
{{- end }}

{{/* The first engine replica's scheduler (pod DNS name through the headless Service): the
tokenizers' and gateways' --scheduler-addr, a fallback once replicas register in Redis. */}}
{{- define "pagedserve.firstScheduler" -}}
{{- $engine := include "pagedserve.component" (dict "root" . "component" "engine") }}
{{- printf "%s-0.%s.%s.svc:%d" $engine $engine .Release.Namespace (int .Values.engine.schedulerPort) }}
{{- end }}

{{- define "pagedserve.apiKeysSecretName" -}}
{{- default (include "pagedserve.component" (dict "root" . "component" "api-keys")) .Values.auth.existingSecret }}
{{- end }}

{{/* key: value map -> env list, values quoted (Kubernetes wants strings). */}}
{{- define "pagedserve.envFromMap" -}}
{{- range $name, $value := . }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end }}

{{/* The model's volume and the --model setting, on workers and tokenizers. */}}
{{- define "pagedserve.modelEnv" -}}
{{- if .Values.model.path }}
- name: PAGEDSERVE_MODEL
  value: {{ .Values.model.path | quote }}
{{- end }}
{{- end }}

{{- define "pagedserve.modelMount" -}}
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "pagedserve.modelVolume" -}}
{{- if .Values.model.volume }}
- name: model
  {{- toYaml .Values.model.volume | nindent 2 }}
{{- end }}
{{- end }}

{{- define "pagedserve.podSpecCommon" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
securityContext: {{- toYaml .Values.podSecurityContext | nindent 2 }}
enableServiceLinks: false
{{- end }}

{{/* Whole cores in a CPU quantity ("4", 4, "2500m" -> 2), at least 1. */}}
{{- define "pagedserve.cpuCount" -}}
{{- $text := toString . }}
{{- if hasSuffix "m" $text }}
{{- max 1 (div (int (trimSuffix "m" $text)) 1000) }}
{{- else }}
{{- max 1 (int (float64 $text)) }}
{{- end }}
{{- end }}
