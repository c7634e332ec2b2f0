"""Shared by tests that make a step fail on purpose: a backend that raises at a chosen op."""


def fail_on(eng, prefix: str, exc: BaseException):
    """Make the engine's backend raise `exc` at the first op whose span name starts with
    `prefix` (e.g. 'b.' for the backward), once. Returns the list the fired name goes into."""
    launch = eng.be.launch
    fired = []

    def patched(stream, op, *args, name=None, **kw):
        if not fired and name is not None and name.startswith(prefix):
            fired.append(name)
            raise exc
        return launch(stream, op, *args, name=name, **kw)

    eng.be.launch = patched
    return fired
