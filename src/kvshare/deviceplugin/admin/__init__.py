"""The node agent's admin side: the admin socket client behind ``kvshare ctl`` and
``kvshare top``, and the Prometheus exporter; they read the broker's views."""
