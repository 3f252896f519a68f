"""Package data: measurements recorded on a real GPU (see graphborrow.studies.shipped)."""
