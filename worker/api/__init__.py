"""The contracts shared by processes (router and workers): imports no torch."""
