// retrace — deterministic replay and fault injection for LibTorch training.
#include <retrace/cli.h>

int main(int argc, char** argv) { return retrace::main(argc, argv); }
