"""The vocabulary shared by kvshare's three programs.

Names (:mod:`.names`), environment variables (:mod:`.env`), quantities (:mod:`.quantity`),
the custom resources (:mod:`.modelserver`, :mod:`.kvsharenode`) and their CRDs
(:mod:`.crds`), and placement (:mod:`.placement`). Programs import from here, never from
each other. Modules are imported individually: the runtime inside engine images uses
only the stdlib-only ones (names, env, quantity, wire).
"""
