"""``kvshare demo``: static partitions against elastic KV caches on one simulated GPU.

The demo is a composition of real programs, each run as its own process:

- :mod:`kvshare.demo.trace` — the seeded, bursty multi-model trace (pure);
- :mod:`kvshare.demo.engine_sim` — an engine scheduler over a KV block allocator (pure);
- :mod:`kvshare.demo.server` — one simulated model server: a real ``KVPool`` driven by
  the engine simulation, under a static lease or the node agent's broker;
- :mod:`kvshare.demo.orchestrator` — starts ``kvshare node`` and the servers, collects
  their samples, checks the memory books, and builds the comparison;
- :mod:`kvshare.demo.view` and :mod:`kvshare.demo.plot` — the live view and the PNG;
- :mod:`kvshare.demo.cli` — the ``kvshare demo`` subcommand.

The orchestrator never imports the runtime or the node agent: it talks to both over
their real interfaces (pipes, the metrics endpoint).
"""
