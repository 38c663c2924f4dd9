from gspo.cli import entry

entry()
