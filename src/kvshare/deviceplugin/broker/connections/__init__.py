"""The broker's side of its sockets: connections and their outboxes, the listening
sockets and what each pod (and the node) may hold open, who may send admin requests and
the admin requests, and the processes watched through pidfds."""
