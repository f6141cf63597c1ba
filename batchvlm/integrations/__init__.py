"""Bridges to the cluster and data systems users already run batchvlm inside (Ray); each imports its system only when used."""
