{{- define "lantau.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "lantau.labels" -}}
app.kubernetes.io/part-of: lantau
app.kubernetes.io/instance: {{ .Release.Name }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "lantau.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag | quote }}
{{- end -}}

{{- define "lantau.scrape" -}}
{{- if .root.Values.scrapeAnnotations -}}
annotations:
  prometheus.io/scrape: "true"
  prometheus.io/port: {{ .port | quote }}
  prometheus.io/path: /metrics
  {{- if .root.Values.tls.secretName }}
  prometheus.io/scheme: https
  {{- end }}
{{- end }}
{{- end -}}

{{- /* HTTPS probes where the pods serve TLS */}}
{{- define "lantau.probeScheme" -}}
{{- if .Values.tls.secretName }}HTTPS{{ else }}HTTP{{ end }}
{{- end }}
