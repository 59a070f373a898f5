"""A stand-in for torchvision, for the engine tests only (tests/conftest.py puts tests/support/engine_stubs on
sys.path inside the engine fixtures, never globally).

SGLang imports torchvision at module level from its multimodal processors, which the DSA indexer's
import chain reaches but never calls. Every name resolves to a placeholder that raises if it is used,
so a test that wanders into image preprocessing fails loudly instead of passing on a fake."""

from torchvision._unavailable import unavailable_module

__version__ = "0.0.0+dispatch-test-stub"
__getattr__ = unavailable_module("torchvision")
