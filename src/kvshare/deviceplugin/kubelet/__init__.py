"""The kubelet side: the device plugin gRPC servers, their registration, the slot ids and
their allocation, the kubelet API stubs and a stand-in kubelet for tests."""
