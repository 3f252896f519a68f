"""Package data: the numbered notebooks and the example sweep grid (see graphborrow.studies.shipped)."""
