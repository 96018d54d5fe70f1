{{/* Names, labels and the image reference shared by every template. */}}

{{- define "kvshare.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* "<release>-kvshare", or the release name alone when it already says kvshare. */}}
{{- define "kvshare.fullname" -}}
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

{{- define "kvshare.operator.fullname" -}}
{{- printf "%s-operator" (include "kvshare.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvshare.nodeAgent.fullname" -}}
{{- printf "%s-node-agent" (include "kvshare.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvshare.webhook.fullname" -}}
{{- printf "%s-webhook" (include "kvshare.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvshare.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kvshare.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvshare
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component ("operator" or "node-agent"): stable across upgrades. */}}
{{- define "kvshare.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvshare.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "kvshare.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Whether the Prometheus Operator's API is served (monitors and rules need it). */}}
{{- define "kvshare.monitoringApi" -}}
{{- if and .Values.monitoring.enabled (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1") }}true{{ end }}
{{- end }}

{{/* The container security context both programs share: nothing beyond what they use. */}}
{{- define "kvshare.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* The KV priority ceilings (kvPriority) as flags of the operator and the node agent. */}}
{{- define "kvshare.kvPriorityArgs" -}}
- --kv-priority-default={{ .Values.kvPriority.default }}
{{- range $namespace, $ceiling := .Values.kvPriority.namespaces }}
- --kv-priority={{ $namespace }}={{ $ceiling }}
{{- end }}
{{- end }}

{{/* The node agent's configuration file: the defaults and the named configurations. */}}
{{- define "kvshare.nodeAgent.configs" -}}
{{- $agent := .Values.nodeAgent }}
{{- $default := dict "slotsPerGpu" $agent.slotsPerGpu "headroom" $agent.headroom "reclaimDeadlineSeconds" $agent.reclaimDeadlineSeconds "fakeGpus" $agent.fakeGpus }}
{{- toYaml (dict "default" $default "configs" $agent.configs) }}
{{- end }}
