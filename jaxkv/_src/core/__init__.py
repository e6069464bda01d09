"""The core operations: init, push and pull eagerly and in traces, updaters, collectives and
compression."""
