"""What several tests share: reference implementations, fixtures' data, fakes and the multi-process
launcher. Import each name from its module (`from tests.support.one_thread import ...`)."""
