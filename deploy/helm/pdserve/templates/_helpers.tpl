{{/* Chart name, truncated for label values. */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: release-chart unless the release already contains the chart name. KubeRay derives
pod and service names from the RayCluster name, so keep it short (<= 40 characters).
*/}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" . }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Pods of the head: KubeRay labels them ray.io/cluster and ray.io/node-type. */}}
{{- define "pdserve.headSelector" -}}
ray.io/cluster: {{ include "pdserve.fullname" . }}
ray.io/node-type: head
{{- end }}

{{- define "pdserve.image" -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion .Values.image.flavor) -}}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* The Ray custom resource a pool's pods advertise and its actors request. */}}
{{- define "pdserve.poolResource" -}}
{{- printf "pdserve_%s" . }}
{{- end }}

{{- define "pdserve.configPath" -}}/etc/pdserve/config.yaml{{- end }}

{{/*
The pdserve config file: .Values.config plus the pool sizes computed from the worker groups.
Fails on a model storage that needs a path but has none.
*/}}
{{- define "pdserve.config" -}}
{{- $cfg := deepCopy .Values.config -}}
{{- range $pool := list "prefill" "decode" }}
{{- $g := index $.Values.workerGroups $pool }}
{{- $key := printf "%s_workers" $pool }}
{{- if not (hasKey $cfg $key) }}
{{- $_ := set $cfg $key (mul $g.replicas $g.workersPerPod) }}
{{- end }}
{{- if $.Values.autoscaling.enabled }}
{{- range $bound := list "min" "max" }}
{{- $bkey := printf "%s_%s_workers" $bound $pool }}
{{- if not (hasKey $cfg $bkey) }}
{{- $pods := index $g (printf "%sReplicas" $bound) }}
{{- $pods = eq $bound "min" | ternary (min $pods $g.replicas) (max $pods $g.replicas) }}
{{- $_ := set $cfg $bkey (mul $pods $g.workersPerPod) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- with .Values.autoscaling }}
{{- if .enabled }}
{{- $_ := set $cfg "autoscale" true }}
{{- $_ := set $cfg "slo_ttft_ms" .sloTtftMs }}
{{- $_ := set $cfg "slo_itl_ms" .sloItlMs }}
{{- $_ := set $cfg "autoscale_interval" .intervalSeconds }}
{{- $_ := set $cfg "autoscale_cooldown_s" .cooldownSeconds }}
{{- if .ttftMissBudget }}
{{- $_ := set $cfg "autoscale_ttft_miss_budget" .ttftMissBudget }}
{{- end }}
{{- if .maxTotalWorkers }}
{{- $_ := set $cfg "autoscale_max_total_workers" (int .maxTotalWorkers) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and (ne .Values.model.storage "image") (not $cfg.model) }}
{{- fail (printf "model.storage is %q: set config.model to the model's path under model.mountPath (%s), e.g. %s/SmolLM2-135M-Instruct.Q4_1.gguf" .Values.model.storage .Values.model.mountPath .Values.model.mountPath) }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/* The model's volumes (by model.storage), mounted in every Ray pod. Empty for "image". */}}
{{- define "pdserve.modelVolumes" -}}
{{- with .Values.model }}
{{- if eq .storage "pvc" }}
{{- if not .pvc.claimName }}{{ fail "model.storage=pvc needs model.pvc.claimName" }}{{ end }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .pvc.claimName }}
    readOnly: true
{{- else if eq .storage "hostPath" }}
{{- if not .hostPath.path }}{{ fail "model.storage=hostPath needs model.hostPath.path" }}{{ end }}
- name: model
  hostPath:
    path: {{ .hostPath.path }}
    type: {{ .hostPath.type }}
{{- else if eq .storage "copy" }}
{{- if not .copy.source }}{{ fail "model.storage=copy needs model.copy.source, a volume source such as {persistentVolumeClaim: {claimName: models}}" }}{{ end }}
- name: model-source
  {{- toYaml .copy.source | nindent 2 }}
- name: model
  emptyDir:
    sizeLimit: {{ .copy.sizeLimit }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdserve.modelVolumeMounts" -}}
{{- if ne .Values.model.storage "image" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: {{ ne .Values.model.storage "copy" }}
{{- end }}
{{- end }}

{{/* Init container that copies the model into the pod-local emptyDir (model.storage=copy). */}}
{{- define "pdserve.initContainers" -}}
{{- if eq .Values.model.storage "copy" }}
- name: copy-model
  image: {{ include "pdserve.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["/bin/sh", "-c"]
  args:
    - cp -a /model-source/. {{ .Values.model.mountPath }}/ && echo "copied model into {{ .Values.model.mountPath }}"
  volumeMounts:
    - name: model-source
      mountPath: /model-source
      readOnly: true
    - name: model
      mountPath: {{ .Values.model.mountPath }}
  resources:
    {{- toYaml .Values.model.copy.resources | nindent 4 }}
{{- end }}
{{- end }}

{{/* Env for every Ray container: transfer settings, the config path, extras. */}}
{{- define "pdserve.env" -}}
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
# the nice level of Ray's worker processes (our engine actors)
- name: RAY_worker_niceness
  value: {{ hasKey .Values.config "worker_niceness" | ternary .Values.config.worker_niceness 15 | toString | quote }}
{{- range $name, $value := .Values.transferEnv }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* A gRPC probe body (grpc.health.v1) on the gRPC port. */}}
{{- define "pdserve.grpcProbe" -}}
grpc:
  port: {{ .port }}
  service: {{ .probe.service | quote }}
periodSeconds: {{ .probe.periodSeconds }}
failureThreshold: {{ .probe.failureThreshold }}
{{- with .probe.timeoutSeconds }}
timeoutSeconds: {{ . }}
{{- end }}
{{- end }}

{{/* The InferencePool's name: inferencePool.name or the release's full name. */}}
{{- define "pdserve.inferencePoolName" -}}
{{- .Values.inferencePool.name | default (include "pdserve.fullname" .) }}
{{- end }}

{{/* The endpoint picker's Service: an existing one (endpointPicker.serviceName) or the chart's. */}}
{{- define "pdserve.eppServiceName" -}}
{{- $epp := .Values.inferencePool.endpointPicker -}}
{{- if $epp.deploy }}
{{- printf "%s-epp" (include "pdserve.inferencePoolName" .) | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- if not $epp.serviceName }}{{ fail "inferencePool.endpointPicker.deploy=false needs inferencePool.endpointPicker.serviceName, the Service of your endpoint picker" }}{{ end }}
{{- $epp.serviceName }}
{{- end }}
{{- end }}

{{- define "pdserve.eppSelector" -}}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/component: endpoint-picker
{{- end }}

{{/* The pool's target port: the head's HTTP port (OpenAI API and /metrics); it must be on. */}}
{{- define "pdserve.inferencePoolPort" -}}
{{- $cfg := .Values.config -}}
{{- $port := hasKey $cfg "http_port" | ternary $cfg.http_port 8000 | int -}}
{{- if not $port }}{{ fail "inferencePool.enabled needs the HTTP port: set config.http_port (it is 0, off)" }}{{ end }}
{{- $port }}
{{- end }}
