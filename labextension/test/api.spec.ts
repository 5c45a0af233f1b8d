/**
 * What the sidebar's idle forms ask the server for, in each tier of hibernation.
 */
import { idleOverride } from '../src/api';

describe('idleOverride', () => {
  it.each([
    ['gpu', 'release_gpu_after_minutes'],
    ['process', 'hibernate_after_minutes']
  ] as const)(
    'sets the %s tier through %s: minutes, 0 for never, null for the server',
    (tier, field) => {
      expect(idleOverride(tier, 'after', 5)).toEqual({ [field]: 5 });
      expect(idleOverride(tier, 'never', 5)).toEqual({ [field]: 0 });
      expect(idleOverride(tier, 'default', 5)).toEqual({ [field]: null });
    }
  );

  it('refuses an idle time that is no number of minutes above 0', () => {
    expect(idleOverride('gpu', 'after', 0)).toBeUndefined();
    expect(idleOverride('gpu', 'after', NaN)).toBeUndefined();
    expect(idleOverride('process', 'after', -1)).toBeUndefined();
    // Never and the server's setting take no minutes.
    expect(idleOverride('gpu', 'never', NaN)).toEqual({ release_gpu_after_minutes: 0 });
  });
});
