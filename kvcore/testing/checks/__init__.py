"""The conformance suite's checks, one module per family (a failing check's name says where
to read it):

========================  ==========================================================
check                     module
========================  ==========================================================
``grammar``,              :mod:`kvcore.testing.checks.format`
``fixtures_exist``
``fixture_contract``      :mod:`kvcore.testing.checks.fixture`
``detect``, ``render``,   :mod:`kvcore.testing.checks.detection`
``geometry``,
``ambiguity[...]``
``containers[...]``       :mod:`kvcore.testing.checks.containers`
``writer``,               :mod:`kvcore.testing.checks.writer`
``writer_view``,
``writer_gather``,
``writer_scatter``
``semantic_gather``,      :mod:`kvcore.testing.checks.semantic`
``semantic_scatter``,
``negative_slots``,
``empty_slots``,
``padded_pool``
``roundtrip[...]``        :mod:`kvcore.testing.checks.roundtrip`
``invalid[...]``          :mod:`kvcore.testing.checks.invalid`
``staging_views``         :mod:`kvcore.testing.checks.staging`
``agrees_with_reference`` :mod:`kvcore.testing.checks.random`
========================  ==========================================================

Shared helpers live in :mod:`kvcore.testing.checks.common` and the cache the data-moving
checks share in :mod:`kvcore.testing.checks.context`. A new check is a function in its
family's module (raise :class:`~kvcore.testing.results.CheckFailure` to fail,
:class:`~kvcore.testing.results.CheckSkip` when it does not apply, return a note), a
:class:`~kvcore.testing.results.Task` for it in :mod:`kvcore.testing.planner`, its name in
:data:`kvcore.testing.planner.CHECKS`, and a line in docs/plugins.md.
"""
