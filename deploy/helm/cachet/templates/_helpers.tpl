{{/* Names and labels. */}}
{{- define "cachet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "cachet.labels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "cachet.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Each service's ports: gRPC (the bridge: REST) and Prometheus /metrics (the bridge: on REST). */}}
{{- define "cachet.ports" -}}
{{- $ports := dict
  "tokenizer" (list 50051 9051)
  "engine" (list 50061 9061)
  "cache" (list 50071 9071)
  "usage" (list 50081 9081)
  "router" (list 50091 9091)
  "bridge" (list 8080 8080) -}}
{{- get $ports . | toJson -}}
{{- end -}}

{{- define "cachet.address" -}}
{{- $port := index (include "cachet.ports" .component | fromJsonArray) 0 -}}
{{- printf "%s-%s:%v" (include "cachet.fullname" .root) .component $port -}}
{{- end -}}

{{/* Where the bridge sends its gRPC calls: the router's Service with one router; with several,
every router pod through the headless Service, a dns:/// target the bridge's channel spreads
round robin over (libs/grpc_channel.py), looked up again whenever a connection drops. */}}
{{- define "cachet.routerTarget" -}}
{{- if gt (int .Values.router.replicas) 1 -}}
{{- printf "dns:///%s-router-headless.%s.svc.cluster.local:%v" (include "cachet.fullname" .) .Release.Namespace (index (include "cachet.ports" "router" | fromJsonArray) 0) -}}
{{- else -}}
{{- include "cachet.address" (dict "root" . "component" "router") -}}
{{- end -}}
{{- end -}}

{{/* The engine replicas' addresses, one per StatefulSet pod, as the JSON list the router and cache take. */}}
{{- define "cachet.engineAddresses" -}}
{{- $name := printf "%s-engine" (include "cachet.fullname" .) -}}
{{- $addresses := list -}}
{{- range $i := until (int .Values.engine.replicas) -}}
{{- $addresses = append $addresses (printf "%s-%d.%s.%s.svc.cluster.local:50061" $name $i $name $.Release.Namespace) -}}
{{- end -}}
{{- $addresses | toJson -}}
{{- end -}}

{{- define "cachet.storeConfigured" -}}
{{- if or .Values.store.existingSecret .Values.store.url -}}true{{- end -}}
{{- end -}}

{{- define "cachet.storeEnv" -}}
{{- if .Values.store.existingSecret }}
- name: CACHET_STORE_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.store.existingSecret }}
      key: {{ .Values.store.secretKey }}
{{- else if .Values.store.url }}
- name: CACHET_STORE_URL
  value: {{ .Values.store.url | quote }}
{{- end }}
{{- end -}}

{{- define "cachet.apiKeysEnv" -}}
- name: CACHET_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ required "auth.apiKeysSecret: the bridge serves beyond loopback only with API keys" .Values.auth.apiKeysSecret }}
      key: {{ .Values.auth.apiKeysSecretKey }}
{{- end -}}

{{- define "cachet.modelEnv" -}}
{{- if .Values.model.name }}
- name: CACHET_MODEL
  value: {{ .Values.model.name | quote }}
{{- end }}
{{- end -}}

{{/* What every service container has: listen beyond loopback, its ports, its drain, the data directory. */}}
{{- define "cachet.commonEnv" -}}
{{- $ports := include "cachet.ports" .component | fromJsonArray -}}
{{- $prefix := printf "CACHET_%s" (upper .component) -}}
- name: {{ $prefix }}_HOST
  value: "0.0.0.0"
{{- if eq .component "bridge" }}
- name: CACHET_PORT
  value: {{ index $ports 0 | quote }}
{{- else }}
- name: {{ $prefix }}_PORT
  value: {{ index $ports 0 | quote }}
- name: {{ $prefix }}_METRICS_PORT
  value: {{ index $ports 1 | quote }}
{{- end }}
- name: {{ $prefix }}_DRAIN_SECONDS
  value: {{ .values.drainSeconds | quote }}
- name: CACHET_DATA_DIR
  value: /var/lib/cachet
{{- include "cachet.tlsEnv" . }}
{{- end -}}

{{/* TLS (cachet.tls): with tls.secretName, every service serves and calls with the Secret's
pair and CA; without, plaintext beyond loopback is allowed explicitly (the services refuse it otherwise). */}}
{{- define "cachet.tlsEnv" -}}
{{- if .root.Values.tls.secretName }}
- name: CACHET_TLS_CERT_FILE
  value: /etc/cachet/tls/tls.crt
- name: CACHET_TLS_KEY_FILE
  value: /etc/cachet/tls/tls.key
- name: CACHET_TLS_CA_FILE
  value: /etc/cachet/tls/ca.crt
{{- if and .root.Values.tls.clientAuth (ne .component "bridge") }}
- name: CACHET_TLS_CLIENT_AUTH
  value: "true"
{{- end }}
{{- else }}
- name: CACHET_TLS_ALLOW_PLAINTEXT
  value: "true"
{{- end }}
{{- end -}}

{{- define "cachet.podAnnotations" -}}
{{- if .root.Values.metrics.annotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ index (include "cachet.ports" .component | fromJsonArray) 1 | quote }}
prometheus.io/path: /metrics
{{/* Under TLS every /metrics is HTTPS (a gRPC service's with a client certificate under tls.clientAuth). */}}
prometheus.io/scheme: {{ ternary "https" "http" (not (empty .root.Values.tls.secretName)) }}
{{- end }}
{{- end -}}

{{/* The data directory (a converted default model, SQLite files without a store), /tmp, and the models' claim. */}}
{{- define "cachet.volumes" -}}
- name: data
  emptyDir: {}
- name: tmp
  emptyDir: {}
# Shared memory beyond the runtime's 64 MiB: a tensor-parallel replica's ranks all-reduce through it.
- name: shm
  emptyDir:
    medium: Memory
{{- if .Values.tls.secretName }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
{{- end }}
{{- if .Values.model.claim }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.model.claim }}
    readOnly: true
{{- end }}
{{- end -}}

{{- define "cachet.volumeMounts" -}}
- name: data
  mountPath: /var/lib/cachet
- name: tmp
  mountPath: /tmp
- name: shm
  mountPath: /dev/shm
{{- if .Values.tls.secretName }}
- name: tls
  mountPath: /etc/cachet/tls
  readOnly: true
{{- end }}
{{- if .Values.model.claim }}
- name: models
  mountPath: /models
  readOnly: true
{{- end }}
{{- end -}}

{{/* Probes: gRPC health for the gRPC services, /health and /ready for the bridge. Liveness
tolerates a whole drain (a draining server reports NOT_SERVING) before the kubelet steps in. */}}
{{- define "cachet.probes" -}}
{{- $port := index (include "cachet.ports" .component | fromJsonArray) 0 -}}
{{- $startupSeconds := .values.startupSeconds | default 300 | int -}}
{{- $scheme := ternary "HTTPS" "HTTP" (not (empty .root.Values.tls.secretName)) -}}
{{/* The kubelet's gRPC probe speaks plaintext only: under TLS a gRPC service is probed by its port. */}}
{{- $grpc := ternary (dict "tcpSocket" (dict "port" $port)) (dict "grpc" (dict "port" $port)) (not (empty .root.Values.tls.secretName)) -}}
{{- $check := ternary (dict "httpGet" (dict "path" "/health" "port" "http" "scheme" $scheme)) $grpc (eq .component "bridge") -}}
{{- $ready := ternary (dict "httpGet" (dict "path" "/ready" "port" "http" "scheme" $scheme)) $grpc (eq .component "bridge") -}}
startupProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: 5
  failureThreshold: {{ div $startupSeconds 5 }}
livenessProbe:
  {{- toYaml $check | nindent 2 }}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: {{ add (div (int .values.drainSeconds) 10) 3 }}
readinessProbe:
  {{- toYaml $ready | nindent 2 }}
  periodSeconds: 5
  timeoutSeconds: 3
  failureThreshold: 2
{{- end -}}

{{/* The service's container: `cachet serve <service>` with its variables, ports, probes, resources. */}}
{{- define "cachet.container" -}}
{{- $ports := include "cachet.ports" .component | fromJsonArray -}}
- name: {{ .component }}
  image: "{{ .root.Values.image.repository }}:{{ .root.Values.image.tag }}"
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  {{- with .command }}
  command:
    {{- toYaml . | nindent 4 }}
  {{- else }}
  args: ["serve", {{ .component | quote }}]
  {{- end }}
  env:
    {{- include "cachet.commonEnv" . | nindent 4 }}
    {{- with .extraEnv }}
    {{- . | nindent 4 }}
    {{- end }}
  {{- if not .follower }}
  ports:
    - name: {{ ternary "http" "grpc" (eq .component "bridge") }}
      containerPort: {{ index $ports 0 }}
    {{- if ne .component "bridge" }}
    - name: metrics
      containerPort: {{ index $ports 1 }}
    {{- end }}
  {{- include "cachet.probes" . | nindent 2 }}
  {{- end }}
  resources:
    {{- toYaml .values.resources | nindent 4 }}
  securityContext:
    {{- toYaml .root.Values.containerSecurityContext | nindent 4 }}
  volumeMounts:
    {{- include "cachet.volumeMounts" .root | nindent 4 }}
{{- end -}}

{{/* Pod fields every workload shares. */}}
{{- define "cachet.podSpec" -}}
terminationGracePeriodSeconds: {{ add (int .values.drainSeconds) (int .root.Values.closeSeconds) }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
containers:
  {{- include "cachet.container" . | nindent 2 }}
volumes:
  {{- include "cachet.volumes" .root | nindent 2 }}
{{- end -}}
