"""The small studies: one question each, one command each (`python -m bench.studies.<name>`),
most with a page under bench/results/ (docs/results.md lists them)."""
