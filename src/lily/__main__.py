from lily.cli import main
import sys
sys.exit(main())
