{{- define "hsx.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "hsx.fullname" -}}
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

{{- define "hsx.selectorLabels" -}}
app.kubernetes.io/name: {{ include "hsx.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "hsx.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "hsx.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: api
app.kubernetes.io/part-of: hsx
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The workers of a multiNode replica: the API's selector labels, their own component. */}}
{{- define "hsx.workerLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "hsx.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: vllm-worker
app.kubernetes.io/part-of: hsx
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "hsx.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "hsx.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "hsx.model" -}}
{{- if .Values.model.path }}{{ .Values.model.path }}{{ else }}{{ required "model.name or model.path is required" .Values.model.name }}{{ end }}
{{- end }}

{{- define "hsx.storageUrl" -}}
{{- if eq .Values.storage.type "s3" }}
{{- printf "s3://%s/%s" (required "storage.s3.bucket is required" .Values.storage.s3.bucket) .Values.storage.s3.prefix }}
{{- else if eq .Values.storage.type "mooncake" }}
{{- printf "mooncake://%s" (include "hsx.mooncake.masterAddress" .) }}
{{- else }}
{{- printf "file://%s" .Values.storage.local.mountPath }}
{{- end }}
{{- end }}

{{/* Mooncake: the master this release runs, or the one it is told about. */}}
{{- define "hsx.mooncake.masterName" -}}
{{- printf "%s-mooncake-master" (include "hsx.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "hsx.mooncake.masterSelectorLabels" -}}
app.kubernetes.io/name: {{ include "hsx.name" . }}-mooncake-master
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "hsx.mooncake.masterLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "hsx.mooncake.masterSelectorLabels" . }}
app.kubernetes.io/component: mooncake-master
app.kubernetes.io/part-of: hsx
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* HOST:PORT of the master's RPC port; a Service name qualified with the namespace,
so the URIs hsx hands out resolve from trainers in other namespaces too. */}}
{{- define "hsx.mooncake.masterAddress" -}}
{{- if .Values.mooncake.master.enabled }}
{{- printf "%s.%s.svc:%d" (include "hsx.mooncake.masterName" .) .Release.Namespace (int .Values.mooncake.master.rpcPort) }}
{{- else }}
{{- required "storage.type=mooncake needs mooncake.master.enabled=true or mooncake.master.address=HOST:PORT" .Values.mooncake.master.address }}
{{- end }}
{{- end }}

{{- define "hsx.mooncake.metricsUrl" -}}
{{- if .Values.mooncake.master.enabled }}
{{- printf "http://%s.%s.svc:%d/metrics" (include "hsx.mooncake.masterName" .) .Release.Namespace (int .Values.mooncake.master.metricsPort) }}
{{- else }}
{{- .Values.mooncake.master.metricsUrl }}
{{- end }}
{{- end }}

{{/* A Kubernetes memory quantity in bytes ("" when it is not one this parses). */}}
{{- define "hsx.memoryBytes" -}}
{{- if or (kindIs "float64" .) (kindIs "int64" .) (kindIs "int" .) }}
{{- printf "%.0f" (float64 .) }}
{{- else if regexMatch "^[0-9]+(\\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$" (toString .) }}
{{- $units := dict "" 1.0 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 }}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?" (toString .) }}
{{- $unit := trimPrefix $number (toString .) }}
{{- printf "%.0f" (mulf (float64 $number) (get $units $unit)) }}
{{- end }}
{{- end }}

{{/* HSX_ENGINE__EXTRA_ARGS (JSON; empty: none): engine.extraArgs, and with multiNode
vLLM's node-0 arguments. master_addr is the leader's own address, which LWS puts in
LWS_LEADER_ADDRESS (Kubernetes expands $(VAR) in env values). */}}
{{- define "hsx.engineExtraArgs" -}}
{{- $args := deepCopy .Values.engine.extraArgs }}
{{- if .Values.multiNode.enabled }}
{{- $_ := set $args "nnodes" (int .Values.multiNode.size) }}
{{- $_ = set $args "node_rank" 0 }}
{{- $_ = set $args "master_addr" "$(LWS_LEADER_ADDRESS)" }}
{{- $_ = set $args "master_port" (int .Values.multiNode.masterPort) }}
{{- end }}
{{- with $args }}{{ toJson . }}{{ end }}
{{- end }}

{{/* Values that contradict each other: refused before anything renders. */}}
{{- define "hsx.validate" -}}
{{- include "hsx.validateMultiNode" . }}
{{- $mc := .Values.mooncake }}
{{- if and $mc.master.enabled $mc.master.address }}
{{- fail "mooncake.master.enabled and mooncake.master.address are both set: run a master in this release or point at an existing one, not both" }}
{{- end }}
{{- $mooncakeOn := or $mc.master.enabled $mc.master.address }}
{{- if and $mooncakeOn (ne .Values.storage.type "mooncake") }}
{{- fail (printf "mooncake.master is set but storage.type is %q: set storage.type=mooncake to write to the Mooncake store, or drop mooncake.master" .Values.storage.type) }}
{{- end }}
{{- if eq .Values.storage.type "mooncake" }}
{{- if not $mooncakeOn }}
{{- fail "storage.type=mooncake needs mooncake.master.enabled=true or mooncake.master.address=HOST:PORT" }}
{{- end }}
{{- range .Values.env }}
{{- if and (kindIs "map" .) (eq (toString .name) "HSX_STORAGE__URL") }}
{{- fail "env sets HSX_STORAGE__URL while storage.type=mooncake: the chart sets it to the Mooncake master; remove it from env" }}
{{- end }}
{{- end }}
{{- if and $mc.master.enabled $mc.master.metricsUrl }}
{{- fail "mooncake.master.metricsUrl is for an existing master (mooncake.master.address); the chart's own master is scraped at its metricsPort" }}
{{- end }}
{{- $limit := include "hsx.memoryBytes" (dig "limits" "memory" "" .Values.resources) }}
{{- $needed := addf (float64 $mc.segmentBytes) (mulf 2 (float64 $mc.bufferBytes)) }}
{{- if and $limit (lt (float64 $limit) $needed) }}
{{- fail (printf "resources.limits.memory (%v) is less than mooncake.segmentBytes + 2 x mooncake.bufferBytes (%.0f bytes, held in the pod's memory besides what vLLM needs): raise the limit or shrink the segment" .Values.resources.limits.memory $needed) }}
{{- end }}
{{- end }}
{{- end }}

{{/* multiNode: one vLLM engine over several pods, so nothing that scales pods one at a
time, and a layout vLLM accepts: tensor parallel over size x gpu.count GPUs, node 0 (TP
rank 0, which writes the states) on the leader. */}}
{{- define "hsx.validateMultiNode" -}}
{{- $mn := .Values.multiNode }}
{{- if $mn.enabled }}
{{- if or .Values.autoscaling.enabled .Values.autoscaling.keda.enabled }}
{{- fail "multiNode.enabled with autoscaling: a replica is a LeaderWorkerSet group of multiNode.size pods, which neither the HPA nor KEDA's ScaledObject scales; turn autoscaling off and set replicaCount" }}
{{- end }}
{{- if lt (int $mn.size) 2 }}
{{- fail (printf "multiNode.size is %d: a replica across nodes needs at least 2 pods (the leader and a worker); for one node, turn multiNode off" (int $mn.size)) }}
{{- end }}
{{- $gpus := mul (int $mn.size) (int .Values.gpu.count) }}
{{- if ne (int .Values.engine.tensorParallelSize) (int $gpus) }}
{{- fail (printf "multiNode: engine.tensorParallelSize (%d) must be multiNode.size x gpu.count (%d x %d = %d): vLLM splits the tensor-parallel ranks evenly over the nodes, gpu.count per pod" (int .Values.engine.tensorParallelSize) (int $mn.size) (int .Values.gpu.count) (int $gpus)) }}
{{- end }}
{{- if not .Values.engine.layerIds }}
{{- fail "multiNode needs engine.layerIds: the workers' vLLM is configured by the chart, which cannot read the model's layer count (hsx's default is [2, L//2, L-3, L])" }}
{{- end }}
{{- range $key := list "nnodes" "node_rank" "master_addr" "master_port" "headless" }}
{{- if hasKey $.Values.engine.extraArgs $key }}
{{- fail (printf "engine.extraArgs sets %s while multiNode.enabled: the chart sets vLLM's multi-node arguments; remove it" $key) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
