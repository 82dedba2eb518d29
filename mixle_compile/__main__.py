from mixle_compile.cli import main

raise SystemExit(main())
