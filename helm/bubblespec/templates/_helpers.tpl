{{/*
Helpers of the BubbleSpec chart. Every helper is named bubblespec.*.
*/}}

{{/* Chart name, truncated to a DNS label. */}}
{{- define "bubblespec.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Full name used as the prefix of every resource. Truncated to 45 characters so that the
longest suffix ("-worker-metrics") still fits a 63-character DNS label.
*/}}
{{- define "bubblespec.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 45 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Chart label value. */}}
{{- define "bubblespec.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels shared by every resource. */}}
{{- define "bubblespec.labels" -}}
helm.sh/chart: {{ include "bubblespec.chart" . }}
{{ include "bubblespec.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: bubblespec
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of the release. */}}
{{- define "bubblespec.selectorLabels" -}}
app.kubernetes.io/name: {{ include "bubblespec.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels of one component. Call with (dict "ctx" $ "component" "scheduler"). */}}
{{- define "bubblespec.componentLabels" -}}
{{ include "bubblespec.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Selector labels of one component. Call with (dict "ctx" $ "component" "scheduler"). */}}
{{- define "bubblespec.componentSelectorLabels" -}}
{{ include "bubblespec.selectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Resource names. */}}
{{- define "bubblespec.scheduler.fullname" -}}
{{- printf "%s-scheduler" (include "bubblespec.fullname" .) -}}
{{- end -}}

{{- define "bubblespec.worker.fullname" -}}
{{- printf "%s-worker" (include "bubblespec.fullname" .) -}}
{{- end -}}

{{- define "bubblespec.worker.serviceName" -}}
{{- printf "%s-worker-metrics" (include "bubblespec.fullname" .) -}}
{{- end -}}

{{- define "bubblespec.redis.fullname" -}}
{{- printf "%s-redis" (include "bubblespec.fullname" .) -}}
{{- end -}}

{{- define "bubblespec.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "bubblespec.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* In-cluster address trainers and workers dial: SERVICE.NAMESPACE.svc:PORT. */}}
{{- define "bubblespec.scheduler.address" -}}
{{- printf "%s.%s.svc:%d" (include "bubblespec.scheduler.fullname" .) .Release.Namespace (int .Values.scheduler.ports.grpc) -}}
{{- end -}}

{{/*
Image reference. Call with (dict "ctx" $ "image" .Values.scheduler.image).
The tag defaults to the chart's appVersion.
*/}}
{{- define "bubblespec.image" -}}
{{- $registry := .ctx.Values.image.registry -}}
{{- $tag := default .ctx.Chart.AppVersion .image.tag -}}
{{- if $registry -}}
{{- printf "%s/%s:%s" (trimSuffix "/" $registry) .image.repository $tag -}}
{{- else -}}
{{- printf "%s:%s" .image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* Token Secret name. */}}
{{- define "bubblespec.auth.secretName" -}}
{{- default (printf "%s-auth" (include "bubblespec.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{/*
A secret value that survives upgrades: the given value, else the one already stored in the
live Secret (lookup; empty when rendering offline), else a random one.
Call with (dict "ctx" $ "secret" NAME "key" KEY "value" GIVEN "length" N).
*/}}
{{- define "bubblespec.secretValue" -}}
{{- if .value -}}
{{- .value -}}
{{- else -}}
{{- $live := lookup "v1" "Secret" .ctx.Release.Namespace .secret -}}
{{- $data := dig "data" (dict) ($live | default (dict)) -}}
{{- if hasKey $data .key -}}
{{- index $data .key | b64dec -}}
{{- else -}}
{{- randAlphaNum (int .length) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Redis: URL, password Secret (name and key; empty name: no password) and TLS CA. */}}
{{- define "bubblespec.redis.url" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s.%s.svc:%d/0" (include "bubblespec.redis.fullname" .) .Release.Namespace (int .Values.redis.port) -}}
{{- else -}}
{{- .Values.redis.external.url -}}
{{- end -}}
{{- end -}}

{{- define "bubblespec.redis.passwordSecretName" -}}
{{- if .Values.redis.enabled -}}
{{- if .Values.redis.auth.enabled -}}
{{- default (printf "%s-redis" (include "bubblespec.fullname" .)) .Values.redis.auth.existingSecret -}}
{{- end -}}
{{- else -}}
{{- .Values.redis.external.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "bubblespec.redis.passwordKey" -}}
{{- if .Values.redis.enabled -}}
{{- .Values.redis.auth.passwordKey -}}
{{- else -}}
{{- .Values.redis.external.passwordKey -}}
{{- end -}}
{{- end -}}

{{- define "bubblespec.redis.caMountPath" -}}
/etc/bubblespec/redis-tls
{{- end -}}

{{- define "bubblespec.redis.caEnabled" -}}
{{- if and (not .Values.redis.enabled) .Values.redis.external.tls.enabled .Values.redis.external.tls.caSecret -}}
true
{{- end -}}
{{- end -}}

{{/* Redis environment variables shared by the scheduler and the workers. */}}
{{- define "bubblespec.redis.env" -}}
- name: BUBBLESPEC_REDIS_URL
  value: {{ include "bubblespec.redis.url" . | quote }}
{{- with include "bubblespec.redis.passwordSecretName" . }}
- name: BUBBLESPEC_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ include "bubblespec.redis.passwordKey" $ }}
{{- end }}
{{- if include "bubblespec.redis.caEnabled" . }}
- name: BUBBLESPEC_REDIS_TLS_CA_FILE
  value: {{ printf "%s/%s" (include "bubblespec.redis.caMountPath" .) .Values.redis.external.tls.caKey | quote }}
{{- end }}
{{- end -}}

{{/* URL of the step journal's Redis (empty: none given, the scheduler uses the draft store's). */}}
{{- define "bubblespec.redis.journalUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s.%s.svc:%d/0" (include "bubblespec.redis.fullname" .) .Release.Namespace (int .Values.redis.journal.port) -}}
{{- else -}}
{{- .Values.redis.external.journalUrl -}}
{{- end -}}
{{- end -}}

{{/* The scheduler's step journal: its Redis and the HMAC key (from the token Secret). With an
existing token Secret the key is optional: without it the scheduler keeps no journal (it warns). */}}
{{- define "bubblespec.journal.env" -}}
{{- with include "bubblespec.redis.journalUrl" . }}
- name: BUBBLESPEC_JOURNAL_REDIS_URL
  value: {{ . | quote }}
{{- end }}
- name: BUBBLESPEC_JOURNAL_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "bubblespec.auth.secretName" . }}
      key: {{ .Values.auth.journalSecretKey }}
      {{- if .Values.auth.existingSecret }}
      optional: true
      {{- end }}
{{- end -}}

{{/* Volume and mount of the Redis CA bundle (nothing when not used). */}}
{{- define "bubblespec.redis.caVolume" -}}
{{- if include "bubblespec.redis.caEnabled" . -}}
- name: redis-tls-ca
  secret:
    secretName: {{ .Values.redis.external.tls.caSecret }}
    items:
      - key: {{ .Values.redis.external.tls.caKey }}
        path: {{ .Values.redis.external.tls.caKey }}
{{- end -}}
{{- end -}}

{{- define "bubblespec.redis.caVolumeMount" -}}
{{- if include "bubblespec.redis.caEnabled" . -}}
- name: redis-tls-ca
  mountPath: {{ include "bubblespec.redis.caMountPath" . }}
  readOnly: true
{{- end -}}
{{- end -}}

{{/* The model volume (hostPath wins over the PVC). */}}
{{- define "bubblespec.model.volume" -}}
- name: model
{{- if .Values.model.hostPath.path }}
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: {{ .Values.model.hostPath.type }}
{{- else }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- end }}
{{- end -}}

{{/* Model directory handed to the worker (and the default tokenizer). */}}
{{- define "bubblespec.model.path" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.name -}}
{{- end -}}

{{/* Pod-level securityContext shared by every pod. */}}
{{- define "bubblespec.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.podSecurity.runAsUser }}
runAsGroup: {{ .Values.podSecurity.runAsGroup }}
fsGroup: {{ .Values.podSecurity.fsGroup }}
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Container-level securityContext shared by every container. */}}
{{- define "bubblespec.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.podSecurity.runAsUser }}
runAsGroup: {{ .Values.podSecurity.runAsGroup }}
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: true
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/*
Probe timings. Call with (dict "probe" .Values.scheduler.livenessProbe); the caller adds
the handler (grpc, httpGet or exec).
*/}}
{{- define "bubblespec.probeTimings" -}}
initialDelaySeconds: {{ .probe.initialDelaySeconds }}
periodSeconds: {{ .probe.periodSeconds }}
timeoutSeconds: {{ .probe.timeoutSeconds }}
failureThreshold: {{ .probe.failureThreshold }}
{{- end -}}

{{/* Cross-field checks that a JSON schema cannot express well. */}}
{{- define "bubblespec.validate" -}}
{{- if and (not .Values.redis.enabled) (not .Values.redis.external.url) -}}
{{- fail "redis.enabled is false: set redis.external.url (redis://HOST:PORT/DB or rediss://HOST:PORT/DB)" -}}
{{- end -}}
{{- if and (not .Values.redis.enabled) .Values.redis.external.tls.enabled (not (hasPrefix "rediss://" .Values.redis.external.url)) -}}
{{- fail "redis.external.tls.enabled is true: redis.external.url must start with rediss://" -}}
{{- end -}}
{{- if and (not .Values.redis.enabled) (not .Values.redis.external.tls.enabled) (hasPrefix "rediss://" .Values.redis.external.url) -}}
{{- fail "redis.external.url starts with rediss://: set redis.external.tls.enabled to true" -}}
{{- end -}}
{{- $journal := .Values.redis.external.journalUrl -}}
{{- if and (not .Values.redis.enabled) $journal (ne (hasPrefix "rediss://" $journal) (hasPrefix "rediss://" .Values.redis.external.url)) -}}
{{- fail "redis.external.journalUrl must use the scheme of redis.external.url (one redis.external.tls covers both)" -}}
{{- end -}}
{{- if and (not .Values.model.hostPath.path) (not .Values.model.pvc.claimName) -}}
{{- fail "set model.pvc.claimName or model.hostPath.path: the workers need a model volume" -}}
{{- end -}}
{{- if and .Values.weights.enabled (not .Values.weights.hostPath.path) (not .Values.weights.pvc.claimName) -}}
{{- fail "weights.enabled is true: set weights.pvc.claimName or weights.hostPath.path" -}}
{{- end -}}
{{- end -}}
