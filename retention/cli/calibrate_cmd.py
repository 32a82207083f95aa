"""Placeholder until its issue lands: no commands yet."""

commands = []
