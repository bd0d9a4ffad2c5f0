"""verify: the MLA decode verifier (cases, bounds, checks, the `mla-verify` CLI, `verify.testing` for your CI).

Import the submodules you need (``verify.cases``, ``verify.checks``, ``verify.testing``, ...); this package imports
nothing itself, so ``import verify`` has no side effects and costs nothing. Note: another PyPI distribution is also
called ``verify``; this one ships as ``mla-verify``.
"""
