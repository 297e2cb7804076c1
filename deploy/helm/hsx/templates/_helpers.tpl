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
{{- else }}
{{- printf "file://%s" .Values.storage.local.mountPath }}
{{- end }}
{{- end }}
