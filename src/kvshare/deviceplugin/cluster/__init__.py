"""The cluster side: the KVShareNode publisher, the watch of this node's pods, their KV
policy annotations handed to the broker, and the checks and configuration of the Node."""
