"""The kubelet's PodResources API (``v1.PodResourcesLister``): stubs generated from
``v1/api.proto`` (:mod:`kvshare.deviceplugin.kubelet.protogen`)."""
