"""Adapters that plug flash_ext into other libraries. Each submodule imports its library only when used:

    flash_ext.integrations.transformers   Hugging Face transformers' attention interface
"""
