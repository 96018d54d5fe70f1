"""The broker's side of its sockets: connections and their outboxes, the listening
sockets, who may connect, the admin requests, and the processes watched through pidfds."""
