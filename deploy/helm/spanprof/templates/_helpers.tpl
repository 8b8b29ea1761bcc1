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

{{/* the admin API, health probes: 503 while stopping or when a component's loop died;
HTTPS with admin.tls (the kubelet does not verify the certificate), never a token (/health
stays open when the admin API wants one).
The admin API listens once the pipeline has started (schema migrations included, which
on a cluster can take a while): the startup probe gives that 5 minutes. */}}
{{- define "spanprof.probes" -}}
{{- $get := printf "{path: /health, port: admin%s}" (ternary ", scheme: HTTPS" "" .Values.admin.tls.enabled) -}}
startupProbe:
  httpGet: {{ $get }}
  periodSeconds: 5
  failureThreshold: 60
readinessProbe:
  httpGet: {{ $get }}
  periodSeconds: 5
livenessProbe:
  httpGet: {{ $get }}
  periodSeconds: 10
  failureThreshold: 6
{{- end -}}

{{/* Secrets are mounted one directory each under here, read-only, and the pipeline config
names the files (never their contents). Not under /etc/spanprof: that is the ConfigMap's
volume, and a mount point inside it would have to be created in a read-only volume. A whole
Secret is mounted (no subPath), so the kubelet's updates reach the pod and spanprof reloads
the files. */}}
{{- define "spanprof.secretsDir" -}}
/var/run/secrets/spanprof
{{- end -}}

{{/* A required value: fails `helm template` / `helm install` with the key and what to do. */}}
{{- define "spanprof.checks" -}}
{{- $g := .Values.gateway }}
{{- $a := .Values.admin }}
{{- if and $g.enabled $g.auth.enabled }}
{{- $_ := required "gateway.auth.tokensSecret.name: name the Secret holding the gateway's tokens file (key gateway.auth.tokensSecret.key, YAML `token: tenant`), or set gateway.auth.enabled=false to accept data from anyone who can reach the gateway" $g.auth.tokensSecret.name }}
{{- end }}
{{- if and $g.enabled $g.tls.enabled }}
{{- $_ := required "gateway.tls.secretName: name the kubernetes.io/tls Secret (tls.crt, tls.key; ca.crt with gateway.tls.clientAuth) for the gateway's listeners" $g.tls.secretName }}
{{- end }}
{{- if $a.tls.enabled }}
{{- $_ := required "admin.tls.secretName: name the kubernetes.io/tls Secret (tls.crt, tls.key) for the admin API" $a.tls.secretName }}
{{- end }}
{{- if $a.auth.enabled }}
{{- $_ := required "admin.auth.tokensSecret.name: name the Secret holding the admin API's tokens file (YAML `token: tenant`), or set admin.auth.enabled=false" $a.auth.tokensSecret.name }}
{{- if .Values.podMonitor.enabled }}
{{- $_ := required "admin.auth.scrapeTokenSecret.name: with admin.auth on, the PodMonitor needs the Secret holding the token Prometheus sends" $a.auth.scrapeTokenSecret.name }}
{{- if not $a.auth.adminTenants }}
{{- fail "admin.auth.adminTenants: with admin.auth on, /metrics answers only tokens of these tenants (others get 403): list the tenant of the PodMonitor's token (admin.auth.scrapeTokenSecret)" }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* A gateway listener's tls: and auth: keys (nothing when both are off). */}}
{{- define "spanprof.gatewayListener" -}}
{{- $g := .Values.gateway }}
{{- $dir := printf "%s/tls" (include "spanprof.secretsDir" .) }}
{{- if $g.tls.enabled }}
tls:
  cert_file: {{ $dir }}/tls.crt
  key_file: {{ $dir }}/tls.key
  {{- if $g.tls.clientAuth }}
  client_ca_file: {{ $dir }}/ca.crt
  {{- end }}
{{- end }}
{{- if $g.auth.enabled }}
auth: {authenticator: tenantauth}
{{- end }}
{{- end -}}

{{/* The extensions a tier starts: tenantauth (the gateway's receivers) and tenantauth/admin
(the admin API of either tier), each reading a tokens file mounted from a Secret. */}}
{{- define "spanprof.extensionIds" -}}
{{- $ids := list }}
{{- if and (eq .tier "gateway") .root.Values.gateway.auth.enabled }}
{{- $ids = append $ids "tenantauth" }}
{{- end }}
{{- if .root.Values.admin.auth.enabled }}
{{- $ids = append $ids "tenantauth/admin" }}
{{- end }}
{{- $ids | toJson }}
{{- end -}}

{{- define "spanprof.extensions" -}}
{{- $dir := include "spanprof.secretsDir" .root }}
{{- $ids := include "spanprof.extensionIds" . | fromJsonArray }}
{{- if $ids }}
extensions:
  {{- if has "tenantauth" $ids }}
  tenantauth:  # the Secret gateway.auth.tokensSecret, mounted
    tokens_file: {{ $dir }}/tokens/tokens.yaml
  {{- end }}
  {{- if has "tenantauth/admin" $ids }}
  tenantauth/admin:  # the Secret admin.auth.tokensSecret, mounted
    tokens_file: {{ $dir }}/admin-tokens/tokens.yaml
    {{- with .root.Values.admin.auth.adminTenants }}
    admin_tenants: {{ toJson . }}  # admin.auth.adminTenants: may read /metrics
    {{- end }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* The Secret volumes of a tier (.tier: gateway or correlator) and their mounts. */}}
{{- define "spanprof.secretVolumes" -}}
{{- $g := .root.Values.gateway }}
{{- $a := .root.Values.admin }}
{{- $gw := eq .tier "gateway" }}
{{- if and $gw $g.tls.enabled }}
- name: tls
  secret:
    secretName: {{ $g.tls.secretName }}
    defaultMode: 0440
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      {{- if $g.tls.clientAuth }}
      - {key: ca.crt, path: ca.crt}
      {{- end }}
{{- end }}
{{- if and $gw $g.auth.enabled }}
- name: tokens
  secret:
    secretName: {{ $g.auth.tokensSecret.name }}
    defaultMode: 0440
    items:
      - {key: {{ $g.auth.tokensSecret.key }}, path: tokens.yaml}
{{- end }}
{{- if $a.tls.enabled }}
- name: admin-tls
  secret:
    secretName: {{ $a.tls.secretName }}
    defaultMode: 0440
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
{{- end }}
{{- if $a.auth.enabled }}
- name: admin-tokens
  secret:
    secretName: {{ $a.auth.tokensSecret.name }}
    defaultMode: 0440
    items:
      - {key: {{ $a.auth.tokensSecret.key }}, path: tokens.yaml}
{{- end }}
{{- end -}}

{{- define "spanprof.secretMounts" -}}
{{- $g := .root.Values.gateway }}
{{- $a := .root.Values.admin }}
{{- $dir := include "spanprof.secretsDir" .root }}
{{- $gw := eq .tier "gateway" }}
{{- if and $gw $g.tls.enabled }}
- {name: tls, mountPath: {{ $dir }}/tls, readOnly: true}
{{- end }}
{{- if and $gw $g.auth.enabled }}
- {name: tokens, mountPath: {{ $dir }}/tokens, readOnly: true}
{{- end }}
{{- if $a.tls.enabled }}
- {name: admin-tls, mountPath: {{ $dir }}/admin-tls, readOnly: true}
{{- end }}
{{- if $a.auth.enabled }}
- {name: admin-tokens, mountPath: {{ $dir }}/admin-tokens, readOnly: true}
{{- end }}
{{- end -}}

{{/* The pods' Prometheus annotations (the admin API's /metrics). */}}
{{- define "spanprof.scrapeAnnotations" -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.admin.port | quote }}
prometheus.io/path: /metrics
{{- if .Values.admin.tls.enabled }}
prometheus.io/scheme: https
{{- end }}
{{- end -}}

{{- define "spanprof.kafkaTopics" -}}
brokers: {{ .Values.kafka.brokers | toJson }}
traces: {topic: {{ .Values.kafka.topics.spans | quote }}}
profiles: {topic: {{ .Values.kafka.topics.profiles | quote }}}
{{- end -}}

{{/* The service section's admin API, telemetry and extensions (.tier: gateway or
correlator). */}}
{{- define "spanprof.telemetry" -}}
{{- $a := .root.Values.admin }}
{{- $dir := printf "%s/admin-tls" (include "spanprof.secretsDir" .root) }}
{{- $ids := include "spanprof.extensionIds" . | fromJsonArray }}
{{- if $ids }}
extensions: {{ $ids | toJson }}
{{- end }}
admin:
  endpoint: "0.0.0.0:{{ $a.port }}"
  {{- if $a.tls.enabled }}
  tls:
    cert_file: {{ $dir }}/tls.crt
    key_file: {{ $dir }}/tls.key
  {{- end }}
  {{- if $a.auth.enabled }}
  # every path but /health (the probes) needs a token
  auth: {authenticator: tenantauth/admin}
  {{- end }}
telemetry:
  logs: {level: {{ .root.Values.logs.level }}, encoding: {{ .root.Values.logs.encoding }}}
{{- end -}}

{{/* The correlator's pod wiring: its Deployment's and the backfill pods' (which run on its
config, Secrets and ClickHouse password), written once so that the two cannot drift. */}}
{{- define "spanprof.correlator.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
fsGroup: 10001  # group owner of the mounted Secrets' files (mode 0440)
{{- end -}}

{{- define "spanprof.correlator.securityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
{{- end -}}

{{/* env entries (none without a password Secret): the config reads ${env:CLICKHOUSE_PASSWORD} */}}
{{- define "spanprof.correlator.env" -}}
{{- with .Values.clickhouse.passwordSecret.name }}
- name: CLICKHOUSE_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.clickhouse.passwordSecret.key }}
{{- end }}
{{- end -}}

{{- define "spanprof.correlator.volumeMounts" -}}
- {name: config, mountPath: /etc/spanprof, readOnly: true}
- {name: tmp, mountPath: /tmp}
{{- with include "spanprof.secretMounts" (dict "root" . "tier" "correlator") | trim }}
{{ . }}
{{- end }}
{{- end -}}

{{- define "spanprof.correlator.volumes" -}}
- name: config
  configMap:
    name: {{ include "spanprof.fullname" . }}-correlator
- name: tmp
  emptyDir: {}
{{- with include "spanprof.secretVolumes" (dict "root" . "tier" "correlator") | trim }}
{{ . }}
{{- end }}
{{- end -}}

{{- /* A backfill pod: `spanprof backfill ARGS --job ID -c <the correlator's config> --format
json --workers N` on the correlator's pod wiring (templates/backfill.yaml). .job: the ledger's
job id, or "" for the pod's Job name (a CronJob's run: each its own job; a retried pod resumes
it); none when ARGS name one. */ -}}
{{- define "spanprof.backfillPod" -}}
{{- $root := .root }}
{{- $b := $root.Values.backfill }}
{{- $args := list }}
{{- $own := true }}
{{- range .args }}
{{- $args = append $args (toString .) }}
{{- if or (eq (toString .) "--job") (hasPrefix "--job=" (toString .)) }}
{{- $own = false }}
{{- end }}
{{- end }}
{{- if $own }}
{{- $args = concat $args (list "--job" (.job | default "$(SPANPROF_JOB)")) }}
{{- end -}}
restartPolicy: Never
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- include "spanprof.correlator.podSecurityContext" $root | nindent 2 }}
containers:
  - name: backfill
    image: {{ include "spanprof.image" $root }}
    imagePullPolicy: {{ $root.Values.image.pullPolicy }}
    args: {{ concat (list "backfill") $args (list "-c" "/etc/spanprof/pipeline.yaml" "--format" "json" "--workers" (toString $b.workers)) | toJson }}
    {{- $env := include "spanprof.correlator.env" $root | trim }}
    {{- if or $env (and $own (not .job)) }}
    env:
      {{- with $env }}
      {{- . | nindent 6 }}
      {{- end }}
      {{- if and $own (not .job) }}
      # the Job the CronJob started (a label Kubernetes sets on its pods)
      - name: SPANPROF_JOB
        valueFrom:
          fieldRef:
            fieldPath: metadata.labels['job-name']
      {{- end }}
    {{- end }}
    securityContext:
      {{- include "spanprof.correlator.securityContext" $root | nindent 6 }}
    volumeMounts:
      {{- include "spanprof.correlator.volumeMounts" $root | nindent 6 }}
    {{- with $b.resources }}
    resources:
      {{- toYaml . | nindent 6 }}
    {{- end }}
volumes:
  {{- include "spanprof.correlator.volumes" $root | nindent 2 }}
{{- with $b.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $b.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $b.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
