{{/* The API's pod (metadata and spec): the Deployment's pods, or each LeaderWorkerSet
group's leader with multiNode.enabled. Rendered at indentation 0; include it with
nindent. */}}
{{- define "hsx.apiPodTemplate" -}}
metadata:
  annotations:
    {{- with .Values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  labels:
    {{- include "hsx.labels" . | nindent 4 }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "hsx.serviceAccountName" . }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
  containers:
    - name: hsx
      image: "{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}"
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      args: ["serve"]
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      ports:
        - name: http
          containerPort: {{ .Values.server.port }}
          protocol: TCP
      env:
        - {name: HSX_SERVER__HOST, value: "0.0.0.0"}
        - {name: HSX_SERVER__PORT, value: {{ .Values.server.port | quote }}}
        - {name: HSX_SERVER__SHUTDOWN_GRACE_S, value: {{ .Values.server.shutdownGraceS | quote }}}
        - {name: HSX_LOG_JSON, value: {{ .Values.server.logJson | quote }}}
        - {name: HSX_ENGINE__MODEL, value: {{ include "hsx.model" . | quote }}}
        - {name: HSX_ENGINE__DTYPE, value: {{ .Values.engine.dtype | quote }}}
        - {name: HSX_ENGINE__TENSOR_PARALLEL_SIZE, value: {{ .Values.engine.tensorParallelSize | quote }}}
        - {name: HSX_ENGINE__GPU_MEMORY_UTILIZATION, value: {{ .Values.engine.gpuMemoryUtilization | quote }}}
        {{- with .Values.engine.layerIds }}
        - {name: HSX_ENGINE__LAYER_IDS, value: {{ toJson . | quote }}}
        {{- end }}
        {{- if gt (int .Values.engine.maxModelLen) 0 }}
        - {name: HSX_ENGINE__MAX_MODEL_LEN, value: {{ .Values.engine.maxModelLen | quote }}}
        {{- end }}
        {{- if gt (int .Values.engine.maxNumBatchedTokens) 0 }}
        - {name: HSX_ENGINE__MAX_NUM_BATCHED_TOKENS, value: {{ .Values.engine.maxNumBatchedTokens | quote }}}
        {{- end }}
        {{- if ne (toString .Values.engine.enablePrefixCaching) "auto" }}
        - {name: HSX_ENGINE__ENABLE_PREFIX_CACHING, value: {{ .Values.engine.enablePrefixCaching | quote }}}
        {{- end }}
        {{- with include "hsx.engineExtraArgs" . }}
        - {name: HSX_ENGINE__EXTRA_ARGS, value: {{ . | quote }}}
        {{- end }}
        {{- if .Values.multiNode.enabled }}
        # The address vLLM's other nodes reach this one at (its message queues).
        - name: VLLM_HOST_IP
          valueFrom: {fieldRef: {fieldPath: status.podIP}}
        {{- end }}
        - {name: HSX_STORAGE__URL, value: {{ include "hsx.storageUrl" . | quote }}}
        - {name: HSX_STORAGE__KEY_PREFIX, value: {{ .Values.storage.keyPrefix | quote }}}
        {{- if eq .Values.storage.type "s3" }}
        {{- with .Values.storage.s3.endpointUrl }}
        - {name: HSX_STORAGE__S3__ENDPOINT_URL, value: {{ . | quote }}}
        {{- end }}
        {{- with .Values.storage.s3.region }}
        - {name: HSX_STORAGE__S3__REGION, value: {{ . | quote }}}
        - {name: AWS_DEFAULT_REGION, value: {{ . | quote }}}
        {{- end }}
        - {name: HSX_STORAGE__S3__ADDRESSING_STYLE, value: {{ .Values.storage.s3.addressingStyle | quote }}}
        - {name: HSX_STORAGE__S3__CHECKSUM_MODE, value: {{ .Values.storage.s3.checksumMode | quote }}}
        {{- with .Values.storage.s3.credentials.existingSecret }}
        - name: AWS_ACCESS_KEY_ID
          valueFrom: {secretKeyRef: {name: {{ . }}, key: {{ $.Values.storage.s3.credentials.accessKeyIdKey }}}}
        - name: AWS_SECRET_ACCESS_KEY
          valueFrom: {secretKeyRef: {name: {{ . }}, key: {{ $.Values.storage.s3.credentials.secretAccessKeyKey }}}}
        {{- end }}
        {{- end }}
        {{- if eq .Values.storage.type "mooncake" }}
        {{- with .Values.mooncake }}
        # This pod's writer is a member of the store: others (the trainers) read the
        # objects in its segment straight from the pod's address.
        - name: HSX_STORAGE__MOONCAKE__LOCAL_HOSTNAME
          valueFrom: {fieldRef: {fieldPath: status.podIP}}
        - {name: HSX_STORAGE__MOONCAKE__SEGMENT_BYTES, value: {{ .segmentBytes | int64 | quote }}}
        - {name: HSX_STORAGE__MOONCAKE__BUFFER_BYTES, value: {{ .bufferBytes | int64 | quote }}}
        - {name: HSX_STORAGE__MOONCAKE__REPLICAS, value: {{ .replicas | quote }}}
        - {name: HSX_STORAGE__MOONCAKE__PROTOCOL, value: {{ .protocol | quote }}}
        - {name: HSX_STORAGE__MOONCAKE__METADATA_SERVER, value: {{ .metadataServer | quote }}}
        - {name: HSX_STORAGE__MOONCAKE__MIN_FREE_BYTES, value: {{ .minFreeBytes | int64 | quote }}}
        {{- if .sharedByNamespaces }}
        - {name: HSX_STORAGE__MOONCAKE__SHARED_BY_NAMESPACES, value: "true"}
        {{- end }}
        {{- with .deviceName }}
        - {name: HSX_STORAGE__MOONCAKE__DEVICE_NAME, value: {{ . | quote }}}
        {{- end }}
        {{- end }}
        {{- with include "hsx.mooncake.metricsUrl" . }}
        - {name: HSX_STORAGE__MOONCAKE__METRICS_URL, value: {{ . | quote }}}
        {{- end }}
        {{- end }}
        {{- if .Values.apiKeys.existingSecret }}
        - {name: HSX_SERVER__API_KEYS_FILE, value: "/etc/hsx/api-keys/{{ .Values.apiKeys.key }}"}
        {{- end }}
        - {name: HSX_LIMITS__MAX_BODY_BYTES, value: {{ .Values.limits.maxBodyBytes | int64 | quote }}}
        - {name: HSX_LIMITS__MAX_PROMPTS, value: {{ .Values.limits.maxPrompts | quote }}}
        - {name: HSX_LIMITS__MAX_TOTAL_TOKENS, value: {{ .Values.limits.maxTotalTokens | int64 | quote }}}
        - {name: HSX_LIMITS__MAX_TOKENS, value: {{ .Values.limits.maxTokens | quote }}}
        - {name: HSX_LIMITS__MAX_QUEUED_PROMPTS, value: {{ .Values.limits.maxQueuedPrompts | quote }}}
        - {name: HSX_LIMITS__REQUEST_TIMEOUT_S, value: {{ .Values.limits.requestTimeoutS | quote }}}
        - {name: HSX_LIMITS__MAX_BYTES_IN_FLIGHT, value: {{ .Values.limits.maxBytesInFlight | int64 | quote }}}
        # A read-only root filesystem: caches and the debug log go to the volumes below.
        - {name: HOME, value: /tmp}
        - {name: HSX_SERVER__DEBUG_LOG, value: /tmp/hsx-debug.log}
        - {name: HF_HOME, value: "{{ .Values.model.cache.mountPath }}/hf"}
        - {name: VLLM_CACHE_ROOT, value: /tmp/vllm}
        {{- with .Values.model.hfTokenSecret.name }}
        - name: HF_TOKEN
          valueFrom: {secretKeyRef: {name: {{ . }}, key: {{ $.Values.model.hfTokenSecret.key }}}}
        {{- end }}
        {{- with .Values.env }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      startupProbe:
        httpGet: {path: /health, port: http}
        periodSeconds: {{ .Values.probes.startup.periodSeconds }}
        failureThreshold: {{ .Values.probes.startup.failureThreshold }}
      livenessProbe:
        httpGet: {path: /health, port: http}
        periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
        failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
      readinessProbe:
        httpGet: {path: /ready, port: http}
        periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
        failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
      lifecycle:
        preStop:
          # Let the Service drop this pod before SIGTERM starts the drain.
          sleep: {seconds: {{ .Values.preStopSleepSeconds }}}
      resources:
        requests:
          {{- with .Values.resources.requests }}
          {{- toYaml . | nindent 10 }}
          {{- end }}
          {{- if gt (int .Values.gpu.count) 0 }}
          {{ .Values.gpu.resourceName }}: {{ .Values.gpu.count }}
          {{- end }}
        limits:
          {{- with .Values.resources.limits }}
          {{- toYaml . | nindent 10 }}
          {{- end }}
          {{- if gt (int .Values.gpu.count) 0 }}
          {{ .Values.gpu.resourceName }}: {{ .Values.gpu.count }}
          {{- end }}
      volumeMounts:
        - {name: shm, mountPath: /dev/shm}
        - {name: tmp, mountPath: /tmp}
        - {name: models, mountPath: {{ .Values.model.cache.mountPath }}}
        {{- if eq .Values.storage.type "local" }}
        - {name: objects, mountPath: {{ .Values.storage.local.mountPath }}}
        {{- end }}
        {{- if .Values.apiKeys.existingSecret }}
        - {name: api-keys, mountPath: /etc/hsx/api-keys, readOnly: true}
        {{- end }}
  volumes:
    - name: shm
      emptyDir: {medium: Memory, sizeLimit: {{ .Values.shm.sizeLimit }}}
    - name: tmp
      emptyDir: {}
    - name: models
      {{- if eq .Values.model.cache.type "pvc" }}
      persistentVolumeClaim:
        claimName: {{ .Values.model.cache.existingClaim | default (printf "%s-models" (include "hsx.fullname" .)) }}
      {{- else }}
      emptyDir: {sizeLimit: {{ .Values.model.cache.size }}}
      {{- end }}
    {{- if eq .Values.storage.type "local" }}
    - name: objects
      persistentVolumeClaim:
        claimName: {{ .Values.storage.local.existingClaim | default (printf "%s-objects" (include "hsx.fullname" .)) }}
    {{- end }}
    {{- if .Values.apiKeys.existingSecret }}
    - name: api-keys
      secret:
        secretName: {{ .Values.apiKeys.existingSecret }}
        items:
          - {key: {{ .Values.apiKeys.key }}, path: {{ .Values.apiKeys.key }}}
    {{- end }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/* A scalar as vLLM's command line takes it: YAML's whole numbers (float64 to Helm)
without an exponent or a fraction. */}}
{{- define "hsx.cliValue" -}}
{{- if kindIs "float64" . }}
{{- if eq . (float64 (int64 .)) }}{{ printf "%d" (int64 .) }}{{ else }}{{ toString . }}{{ end }}
{{- else }}
{{- toString . }}
{{- end }}
{{- end }}
