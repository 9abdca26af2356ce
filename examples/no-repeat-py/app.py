"""Entry module for componentize-py (`componentize app`). The implementation of the exported
`logits-processor` interface is the module `logits_processor` next to this file."""

import logits_processor  # noqa: F401
