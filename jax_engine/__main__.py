from jax_engine.cli import main

main()
