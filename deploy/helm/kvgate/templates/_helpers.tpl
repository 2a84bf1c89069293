{{- define "kvgate.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvgate.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvgate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* selector labels of one component: (dict "root" $ "component" "router") */}}
{{- define "kvgate.selector" -}}
app.kubernetes.io/name: {{ include "kvgate.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvgate.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "kvgate.secretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-keys" (include "kvgate.fullname" .)) -}}
{{- end -}}

{{/* environment every kvgate container gets: its settings file and its keys */}}
{{- define "kvgate.env" -}}
- name: KVGATE_CONFIG
  value: /etc/kvgate/kvgate.yaml
{{- range $name, $key := dict "KVGATE_ADMISSION__TENANTS" "tenants" "KVGATE_ROUTER__GATEWAY_KEYS" "gateway-keys" "KVGATE_ROUTER__ADMIN_KEYS" "admin-keys" "KVGATE_CLICKHOUSE__PASSWORD" "clickhouse-password" "KVGATE_REDIS__PASSWORD" "redis-password" "KVGATE_KAFKA__SASL_PASSWORD" "kafka-sasl-password" }}
- name: {{ $name }}
  valueFrom:
    secretKeyRef:
      name: {{ include "kvgate.secretName" $ }}
      key: {{ $key }}
      optional: true
{{- end }}
{{- end -}}

{{- define "kvgate.volumeMounts" -}}
- name: config
  mountPath: /etc/kvgate
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- end -}}

{{- define "kvgate.volumes" -}}
- name: config
  configMap:
    name: {{ include "kvgate.fullname" . }}-config
- name: tmp
  emptyDir: {}
{{- end -}}

{{/*
The node agent as a sidecar of an engine pod: (dict "root" $ "engineName" "llama-0"
"enginePort" 8000 "kvEventsPort" 5557 "replayPort" 5558). It scrapes the engine on loopback and
advertises the pod's IP to the routers.
*/}}
{{- define "kvgate.agentSidecar" -}}
- name: kvgate-agent
  image: {{ include "kvgate.image" .root }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  args:
    - agent
    - --node-id=$(POD_NAME)
    - --engine-url=http://127.0.0.1:{{ .enginePort }}
    - --advertise-url=http://$(POD_IP):{{ .enginePort }}
    - --kv-events=tcp://127.0.0.1:{{ .kvEventsPort }}
    - --kv-events-replay=tcp://127.0.0.1:{{ .replayPort }}
  env:
    - name: POD_NAME
      valueFrom: {fieldRef: {fieldPath: metadata.name}}
    - name: POD_IP
      valueFrom: {fieldRef: {fieldPath: status.podIP}}
    - name: KVGATE_AGENT__METRICS_HOST
      value: 0.0.0.0
    - name: KVGATE_AGENT__METRICS_PORT
      value: {{ .root.Values.agent.metricsPort | quote }}
    # the simulated engine keeps an agent session's KV between turns when asked (agent_hint)
    - name: KVGATE_AGENT__RETENTION_HINTS
      value: "true"
    {{- include "kvgate.env" .root | nindent 4 }}
  ports:
    - name: agent-metrics
      containerPort: {{ .root.Values.agent.metricsPort }}
  resources: {{- toYaml .root.Values.agent.resources | nindent 4 }}
  securityContext: {{- toYaml .root.Values.securityContext | nindent 4 }}
  volumeMounts: {{- include "kvgate.volumeMounts" .root | nindent 4 }}
{{- end -}}

{{/*
A Deployment of one kvgate component without a port (worker, sink):
(dict "root" $ "component" "worker" "spec" .Values.worker)
*/}}
{{- define "kvgate.deployment" -}}
{{- $root := .root -}}
{{- $sel := dict "root" $root "component" .component -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "kvgate.fullname" $root }}-{{ .component }}
  labels:
    {{- include "kvgate.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
spec:
  replicas: {{ .spec.replicas }}
  selector:
    matchLabels: {{- include "kvgate.selector" $sel | nindent 6 }}
  template:
    metadata:
      labels: {{- include "kvgate.selector" $sel | nindent 8 }}
      annotations:
        checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
    spec:
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets: {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext: {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      containers:
        - name: {{ .component }}
          image: {{ include "kvgate.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args: [{{ .component | quote }}]
          env:
            {{- include "kvgate.env" $root | nindent 12 }}
            {{- with .spec.metricsPort }}
            {{- /* the worker's metrics are a page of its Faust web server */}}
            {{- $key := ternary "WEB" "METRICS" (eq $.component "worker") }}
            - name: KVGATE_{{ upper $.component }}__{{ $key }}_HOST
              value: 0.0.0.0
            - name: KVGATE_{{ upper $.component }}__{{ $key }}_PORT
              value: {{ . | quote }}
            {{- end }}
            {{- with .spec.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- with .spec.metricsPort }}
          ports:
            - name: metrics
              containerPort: {{ . }}
          readinessProbe:
            httpGet: {path: /health, port: metrics}
          {{- end }}
          resources: {{- toYaml .spec.resources | nindent 12 }}
          securityContext: {{- toYaml $root.Values.securityContext | nindent 12 }}
          volumeMounts: {{- include "kvgate.volumeMounts" $root | nindent 12 }}
      volumes: {{- include "kvgate.volumes" $root | nindent 8 }}
{{- end -}}
