"""What the loader workers' fork server imports once, before its first fork.

Only that server imports this module (``worker_server.PRELOAD`` names it).
Besides our data code (which brings torch, torchvision and PIL), it makes
the server's own exit immediate: when the trainer exits, the server would
otherwise spend 1-2 s tearing down torch at interpreter exit while it still
holds the trainer's stdout and stderr, so a pipe such as ``train_net.py |
tee log`` or a launcher that reads them stayed open that long. The server
holds nothing to flush or save; its workers exit by ``os._exit`` already.
"""

import atexit
import os

import distribuuuu.data  # noqa: F401  (the workers' code, imported once)

# The last handler registered runs first: nothing after it runs.
atexit.register(os._exit, 0)
