"""How many Triton kernels the learner's code launched: counted in the worker, beside
it, and sent back with each reply, so a right answer computed without Triton is told
apart from the drill (the kernel tests fail it). Names no drill; imports nothing of ours.

On a GPU Triton calls `knobs.runtime.launch_enter_hook` before every launch (a
HookChain with add/remove in Triton 3.9, a plain callable or None in 3.6). The CPU
interpreter runs no launcher and calls no hook: there every launch is a call of
`triton.runtime.interpreter.GridExecutor.__call__`, which we wrap. A learner's file can
see either and fake a launch (a do-nothing kernel): the count tells an honest PyTorch
answer from a Triton one; the values are checked in the test process either way.
"""
import os

_count = [0]


def _on_launch(*args, **kwargs):
    _count[0] += 1


def install():
    """Start counting in this process (once). Returns a function giving the count so far."""
    if getattr(install, "done", False):
        return lambda: _count[0]
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        from triton.runtime import interpreter
        launch = interpreter.GridExecutor.__call__

        def counted(self, *args, **kwargs):
            _on_launch()
            return launch(self, *args, **kwargs)
        interpreter.GridExecutor.__call__ = counted
    else:
        from triton import knobs
        hook = knobs.runtime.launch_enter_hook
        if hasattr(hook, "add"):
            hook.add(_on_launch)
        else:
            def chained(*args, **kwargs):
                _on_launch()
                if hook is not None:
                    hook(*args, **kwargs)
            knobs.runtime.launch_enter_hook = chained
    install.done = True
    return lambda: _count[0]
