"""What every layer shares, importing nothing of the project: exit statuses and disk-space checks."""
