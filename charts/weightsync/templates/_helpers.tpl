{{/* The release's name for every object of the chart, within the 63 characters of a label. */}}
{{- define "weightsync.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "weightsync.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "weightsync.labels" -}}
{{ include "weightsync.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: operator
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "weightsync.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "weightsync.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the key every job's token is derived from. */}}
{{- define "weightsync.tokenKeySecret" -}}
{{- printf "%s-token-key" (include "weightsync.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* A scrape job's relabelling of a pod that asks to be scraped: its address, path and names. */}}
{{- define "weightsync.scrapeRelabel" -}}
- source_labels: [__meta_kubernetes_pod_annotation_prometheus_io_scrape]
  regex: "true"
  action: keep
- source_labels: [__meta_kubernetes_pod_phase]
  regex: Pending|Succeeded|Failed
  action: drop
- source_labels: [__meta_kubernetes_pod_ip, __meta_kubernetes_pod_annotation_prometheus_io_port]
  regex: (.+);(\d+)
  replacement: $1:$2
  target_label: __address__
- source_labels: [__meta_kubernetes_pod_annotation_prometheus_io_path]
  regex: (.+)
  target_label: __metrics_path__
- source_labels: [__meta_kubernetes_namespace]
  target_label: namespace
- source_labels: [__meta_kubernetes_pod_name]
  target_label: pod
{{- end -}}

{{/* "true" where the cluster serves ValidatingAdmissionPolicy v1 (Kubernetes 1.30+): helm install
and upgrade ask the cluster; `helm template` knows it from --api-versions or --kube-version. */}}
{{- define "weightsync.admissionPolicyServed" -}}
{{- if or (.Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy") (semverCompare ">=1.30.0-0" .Capabilities.KubeVersion.Version) -}}
true
{{- end -}}
{{- end -}}
