"""megatron-core integration: METP process groups, modules, layer spec, checkpoint mapping."""
