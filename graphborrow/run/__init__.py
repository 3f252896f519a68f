"""What runs the notebooks and the command line: the suite, the demo, results files, sweeps, the
notebook points, the results guard and the docs build. Import the modules; the package itself
exports nothing."""

__all__: list[str] = []
