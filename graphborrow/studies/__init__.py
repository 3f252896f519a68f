"""What the notebooks show, as library functions: presets and setup, pool studies, capacity grids,
hazards, sampling checks, plots, the explorer and the H200's measured data. Import the modules
(``from graphborrow.studies import plots``); the package itself exports nothing."""

__all__: list[str] = []
