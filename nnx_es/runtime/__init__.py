"""The runtime core: one run's microbatches, updates, epochs and commits (docs/ARCHITECTURE.md).

``window`` (an accumulation window's held losses and their one read) <- ``engine`` (the
computation: microbatches and updates, returning values) <- ``parallel`` (data parallelism, a
strategy the engine is given) ; ``steps`` (results into events, hooks, update-clock schedulers)
<- ``loop`` (the epoch walk) <- ``scope`` (one fit's run, built by constructors); ``context``
(what hooks see and ask for).
"""
