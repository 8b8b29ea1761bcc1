{{- define "spanprof.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "spanprof.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "spanprof.labels" -}}
app.kubernetes.io/name: {{ include "spanprof.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "spanprof.selector" -}}
app.kubernetes.io/name: {{ include "spanprof.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "spanprof.image" -}}
{{ printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end -}}

{{/* the admin API, health probes: 503 while stopping or when a component's loop died.
The admin API listens once the pipeline has started (schema migrations included, which
on a cluster can take a while): the startup probe gives that 5 minutes. */}}
{{- define "spanprof.probes" -}}
startupProbe:
  httpGet: {path: /health, port: admin}
  periodSeconds: 5
  failureThreshold: 60
readinessProbe:
  httpGet: {path: /health, port: admin}
  periodSeconds: 5
livenessProbe:
  httpGet: {path: /health, port: admin}
  periodSeconds: 10
  failureThreshold: 6
{{- end -}}

{{- define "spanprof.kafkaTopics" -}}
brokers: {{ .Values.kafka.brokers | toJson }}
traces: {topic: {{ .Values.kafka.topics.spans | quote }}}
profiles: {topic: {{ .Values.kafka.topics.profiles | quote }}}
{{- end -}}

{{- define "spanprof.telemetry" -}}
admin:
  endpoint: "0.0.0.0:{{ .Values.admin.port }}"
telemetry:
  logs: {level: {{ .Values.logs.level }}, encoding: {{ .Values.logs.encoding }}}
{{- end -}}
