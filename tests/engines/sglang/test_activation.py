"""sitecustomize activation of the installed engine, in fresh interpreters."""

from tests.engines.activation_checks import (  # noqa: F401 - collected here, for this engine
    test_disabled_bundle_touches_nothing,
    test_enabled_bundle_on_pythonpath_patches_the_engine_and_chains_the_image_hook,
    test_installed_kvshare_activates_from_its_boot_directory,
    test_unsupported_version_is_refused_with_the_supported_list,
)
