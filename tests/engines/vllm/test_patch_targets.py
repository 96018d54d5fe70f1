"""Every vLLM patch target exists with the expected signature; a moved one refuses loudly."""

from tests.engines.patch_targets import (  # noqa: F401 - collected here, for this engine
    test_a_moved_target_fails_naming_the_version_and_patches_nothing,
    test_activation_replaces_every_target_once,
    test_every_target_and_requirement_matches_the_installed_engine,
)
