"""`mmpipe check`: the run's own ranks check their environment, links, pipeline == single device and
loader before the real run (docs/check.md). main: the front door's verdict; rank: the rank entry."""
