"""Stubs of the kubelet device plugin API v1beta1, generated from ``api.proto`` by
:mod:`kvshare.deviceplugin.kubelet.protogen` (``make proto``); import them through
:mod:`kvshare.deviceplugin.kubelet.kubelet_api`."""
