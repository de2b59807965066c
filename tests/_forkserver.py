"""Imported by the workers' fork server, last of its preloads (tests/_worker.py): it
confines the server itself with Landlock to the sandbox root (DRILLS_SANDBOX_ROOT),
before it forks any worker. A worker confines itself further, to its own scratch
folder; but any process may ask a fork server for a child, and this server's children
run what the request holds, so the server must be no freer than what it serves.
Names no drill; imports nothing of ours but tests/_sandbox.py.
"""
import os

import _sandbox

if os.environ.get("DRILLS_SANDBOX_ROOT") and _sandbox.abi():
    _sandbox.confine(os.environ["DRILLS_SANDBOX_ROOT"])
