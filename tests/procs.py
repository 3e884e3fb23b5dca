"""Run Bourse programs as real subprocesses (the product's own launcher)."""

from buyer_cli.launcher import Program, start_program

start = start_program
Proc = Program
