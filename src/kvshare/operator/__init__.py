"""The cluster operator: ModelServer resources placed onto shared GPUs.

``kvshare operator`` (:mod:`.cli`, :mod:`.app`) runs kopf with the handlers of
:mod:`.handlers`, which only translate watch events into calls of the
:class:`~.controller.Controller`. The controller reads the cluster from kopf's indexes
(:mod:`.caches` of :mod:`.views`), checks the spec (:mod:`.validation`), keeps what it
remembers between runs in :mod:`.quota_holds`, :mod:`.capacity_waits`,
:mod:`.kv_annotation` and :mod:`.wakeups`, and calls the pure parts: :mod:`.capacity`
and :mod:`.plan` (what to create and delete, through :mod:`kvshare.api.placement`),
:mod:`.render` (pods, Services, the runtime injection) and :mod:`.status` (phase,
conditions, Events). Its writes go through :mod:`.client`. Settings live in
:mod:`.settings`, metrics in :mod:`.metrics`, the API calls it makes (for RBAC) in
:mod:`.rbac`, the admission webhook in :mod:`.webhook`.
"""
